# Run by `cmake --install` (and by cpack) for the daemon component: installs deploy/ with the
# paths of this installation written in, since they are known only at install time (the
# prefix given to `cmake --install --prefix`, or /usr for the Debian packages):
#   lib/systemd/system/ckptd.service   ExecStart= names PREFIX/bin/ckptd and ETC/ckptd/ckptd.conf
#   libexec/ckptd/*.sh                  the Slurm scripts; their default CKPTD_BIN is PREFIX/bin/ckptd
#   ETC/ckptd/ckptd.conf                the daemon's configuration (deploy/ckptd.conf)
#   ETC/default/ckptd                   the Slurm scripts' settings (deploy/slurm/ckptd-slurm.env)
# ETC is /etc under the prefix /usr, else PREFIX/etc. A configuration file that exists
# already is kept (an operator's edits are never overwritten by a reinstall).
# Set by cmake/Install.cmake: CKPT_DEPLOY_DIR, CKPT_STAGE_DIR, CKPT_BINDIR, CKPT_LIBEXECDIR,
# CKPT_DOCDIR.
set(prefix "${CMAKE_INSTALL_PREFIX}")
if(prefix STREQUAL "/usr")
  set(etc "/etc")
else()
  set(etc "${prefix}/etc")
endif()
# One staging directory per destination, so that installs to different places (a prefix, a
# package) may run at once from one build tree.
string(MD5 destination "$ENV{DESTDIR}${prefix}")
set(CKPT_STAGE_DIR "${CKPT_STAGE_DIR}/${destination}")
set(bindir "${prefix}/${CKPT_BINDIR}")
set(libexecdir "${prefix}/${CKPT_LIBEXECDIR}/ckptd")

# deploy/ is written for a /usr/local install by hand; these are its paths.
function(ckpt_stage_with_paths source name out)
  file(READ "${source}" text)
  string(REPLACE "/usr/local/bin/ckptd" "${bindir}/ckptd" text "${text}")
  string(REPLACE "/usr/local/libexec/ckptd" "${libexecdir}" text "${text}")
  string(REPLACE "file:///usr/local/share/doc/ckptd" "file://${prefix}/${CKPT_DOCDIR}" text "${text}")
  string(REPLACE "/etc/ckptd/" "${etc}/ckptd/" text "${text}")
  string(REPLACE "/etc/default/ckptd" "${etc}/default/ckptd" text "${text}")
  file(WRITE "${CKPT_STAGE_DIR}/${name}" "${text}")
  set(${out} "${CKPT_STAGE_DIR}/${name}" PARENT_SCOPE)
endfunction()

ckpt_stage_with_paths("${CKPT_DEPLOY_DIR}/ckptd.service" ckptd.service unit)
file(INSTALL "${unit}" DESTINATION "${prefix}/lib/systemd/system")

set(scripts)
foreach(script prolog.sh epilog.sh task_prolog.sh common.sh)
  ckpt_stage_with_paths("${CKPT_DEPLOY_DIR}/slurm/${script}" "${script}" staged)
  list(APPEND scripts "${staged}")
endforeach()
# common.sh is sourced by the others, never run.
file(INSTALL ${scripts} DESTINATION "${libexecdir}"
     FILE_PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE GROUP_READ GROUP_EXECUTE WORLD_READ WORLD_EXECUTE)
file(CHMOD "$ENV{DESTDIR}${libexecdir}/common.sh" PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ)

foreach(pair "ckptd.conf;ckptd;ckptd.conf" "slurm/ckptd-slurm.env;default;ckptd")
  list(GET pair 0 source)
  list(GET pair 1 dir)
  list(GET pair 2 name)
  if(EXISTS "$ENV{DESTDIR}${etc}/${dir}/${name}")
    message(STATUS "Keeping existing configuration: $ENV{DESTDIR}${etc}/${dir}/${name}")
    continue()
  endif()
  ckpt_stage_with_paths("${CKPT_DEPLOY_DIR}/${source}" "${name}" staged)
  file(INSTALL "${staged}" DESTINATION "${etc}/${dir}" FILE_PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ)
endforeach()

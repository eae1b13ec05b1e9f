# Debian packages of the install components (cmake/Install.cmake), built by CPack from a
# build tree:
#
#   cpack -G DEB --config build/CPackConfig.cmake -B OUTDIR
#
#   ckptd_V-1_ARCH.deb        component daemon: ckptd, ckptctl, the systemd unit, the
#                             sysusers.d/tmpfiles.d entries, the Slurm scripts, /etc/ckptd/ckptd.conf
#                             and /etc/default/ckptd (both conffiles)
#   libckpt0_V-1_ARCH.deb     component runtime: libckpt.so.0 (with its shlibs and ldconfig trigger)
#   libckpt-dev_V-1_ARCH.deb  component dev: headers, libckpt.so, the CMake package, ckpt.pc
#
# Installed under /usr (configuration under /etc). Depends on the Debian runtime libraries
# come from dpkg-shlibdeps (dpkg-dev); libckpt-dev depends on the same libckpt0. The
# maintainer scripts (deploy/debian/) make the group and directories of the sysusers.d and
# tmpfiles.d entries, and never remove checkpoints.
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME ckptd)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_CONTACT "ckptd maintainers <ckptd@localhost>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "node-local checkpoint daemon for large-model training")
# The install runs with CMAKE_INSTALL_PREFIX=/usr (CPACK_INSTALL_PREFIX) under DESTDIR,
# whatever prefix the build tree was configured with, so that the paths
# cmake/install_deploy.cmake writes into the unit and scripts are the packaged ones.
set(CPACK_SET_DESTDIR ON)
set(CPACK_INSTALL_PREFIX /usr)
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_STRIP_FILES ON)
set(CPACK_COMPONENTS_ALL daemon runtime dev)
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_RELEASE 1)
set(CPACK_DEBIAN_COMPRESSION_TYPE gzip)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS ON)
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
set(ckpt_deb_version "${PROJECT_VERSION}-${CPACK_DEBIAN_PACKAGE_RELEASE}")

set(CPACK_DEBIAN_DAEMON_PACKAGE_NAME ckptd)
set(CPACK_DEBIAN_DAEMON_PACKAGE_SECTION admin)
# systemd-sysusers and systemd-tmpfiles, used by postinst when present.
set(CPACK_DEBIAN_DAEMON_PACKAGE_RECOMMENDS systemd)
set(CPACK_DEBIAN_DAEMON_DESCRIPTION "node-local checkpoint daemon for large-model training
 ckptd copies registered trainer state out of shared or GPU memory while the
 trainer computes, writes it through node-local and persistent tiers and commits
 each version across ranks. This package holds the daemon, the ckptctl tool, the
 systemd unit (not enabled at install), the sysusers.d/tmpfiles.d entries and
 the Slurm prolog, epilog and TaskProlog scripts.")
set(CPACK_DEBIAN_DAEMON_PACKAGE_CONTROL_EXTRA
    ${CMAKE_CURRENT_SOURCE_DIR}/deploy/debian/postinst ${CMAKE_CURRENT_SOURCE_DIR}/deploy/debian/prerm
    ${CMAKE_CURRENT_SOURCE_DIR}/deploy/debian/postrm ${CMAKE_CURRENT_SOURCE_DIR}/deploy/debian/conffiles)

set(CPACK_DEBIAN_RUNTIME_PACKAGE_NAME libckpt0)
set(CPACK_DEBIAN_RUNTIME_PACKAGE_SECTION libs)
set(CPACK_DEBIAN_RUNTIME_DESCRIPTION "client library of ckptd (shared library)
 libckpt is the library a trainer links to register its state with ckptd and
 take, wait for and restore checkpoints.")

set(CPACK_DEBIAN_DEV_PACKAGE_NAME libckpt-dev)
set(CPACK_DEBIAN_DEV_PACKAGE_SECTION libdevel)
set(CPACK_DEBIAN_DEV_PACKAGE_DEPENDS "libckpt0 (= ${ckpt_deb_version})")
# Headers, a symlink and text files: nothing for dpkg-shlibdeps.
set(CPACK_DEBIAN_DEV_PACKAGE_SHLIBDEPS OFF)
set(CPACK_DEBIAN_DEV_DESCRIPTION "client library of ckptd (development files)
 Headers (<ckpt/client.h>), the CMake package (find_package(ckpt CONFIG),
 target ckpt::ckpt) and the pkg-config file (ckpt.pc) of libckpt.")

include(CPack)

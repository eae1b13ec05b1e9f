# What `cmake --install` puts where, in three components, which are also the three Debian
# packages of cmake/Packaging.cmake:
#   daemon   bin/ckptd, bin/ckptctl; the systemd unit (lib/systemd/system/ckptd.service);
#            the sysusers.d and tmpfiles.d entries of its group and directories; the Slurm
#            prolog, epilog and TaskProlog (libexec/ckptd/); the configuration
#            (etc/ckptd/ckptd.conf, and etc/default/ckptd for the Slurm scripts); the service
#            guide (share/doc/ckptd/docs/ops/).
#   runtime  lib/libckpt.so.0 and the file it names.
#   dev      include/ckpt/*.h (self-contained: client.h needs only its neighbours),
#            lib/libckpt.so, the CMake package lib/cmake/ckpt/ (find_package(ckpt 0.1 CONFIG)
#            gives ckpt::ckpt) and lib/pkgconfig/ckpt.pc.
# Paths are relative to the prefix, so any prefix works and the installed tree can be moved:
# the CMake package and ckpt.pc find the library and headers relative to themselves. The
# paths written into the unit and the Slurm scripts are those of the prefix given at install
# time (cmake/install_deploy.cmake); under the prefix /usr (the Debian packages) the
# configuration goes to /etc.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS ckptd ckptctl RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT daemon)

install(TARGETS ckpt EXPORT ckptTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT runtime NAMELINK_COMPONENT dev)
install(FILES client/include/ckpt/client.h types/include/ckpt/dtype.h types/include/ckpt/export.h
              types/include/ckpt/level.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/ckpt COMPONENT dev)

set(CKPT_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/ckpt)
install(EXPORT ckptTargets NAMESPACE ckpt:: DESTINATION ${CKPT_CMAKE_DIR} COMPONENT dev)
configure_package_config_file(cmake/ckptConfig.cmake.in ${CMAKE_CURRENT_BINARY_DIR}/ckptConfig.cmake
                              INSTALL_DESTINATION ${CKPT_CMAKE_DIR})
# 0.x: a trainer built for 0.1 takes any 0.1.y, and no 0.2 (SameMajorVersion with major 0
# still refuses a lower minor version than asked for).
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/ckptConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMajorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/ckptConfig.cmake ${CMAKE_CURRENT_BINARY_DIR}/ckptConfigVersion.cmake
        DESTINATION ${CKPT_CMAKE_DIR} COMPONENT dev)

# ckpt.pc: the prefix relative to the file itself (${pcfiledir}), so it works wherever the
# tree is; `pkg-config --variable=cuda ckpt` says whether GPU tensors are supported.
file(RELATIVE_PATH CKPT_PC_PREFIX "/p/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/p")
string(REGEX REPLACE "/$" "" CKPT_PC_PREFIX "${CKPT_PC_PREFIX}")
if(CKPT_HAVE_CUDA)
  set(CKPT_PC_CUDA yes)
else()
  set(CKPT_PC_CUDA no)
endif()
configure_file(cmake/ckpt.pc.in ${CMAKE_CURRENT_BINARY_DIR}/ckpt.pc @ONLY)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/ckpt.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig COMPONENT dev)

install(FILES deploy/ckptd.sysusers DESTINATION lib/sysusers.d RENAME ckptd.conf COMPONENT daemon)
install(FILES deploy/ckptd.tmpfiles DESTINATION lib/tmpfiles.d RENAME ckptd.conf COMPONENT daemon)
install(FILES docs/ops/service.md docs/ops/slurm.md DESTINATION ${CMAKE_INSTALL_DOCDIR}/docs/ops COMPONENT daemon)
install(CODE "set(CKPT_DEPLOY_DIR \"${CMAKE_CURRENT_SOURCE_DIR}/deploy\")
set(CKPT_STAGE_DIR \"${CMAKE_CURRENT_BINARY_DIR}/deploy-staged\")
set(CKPT_BINDIR \"${CMAKE_INSTALL_BINDIR}\")
set(CKPT_LIBEXECDIR \"${CMAKE_INSTALL_LIBEXECDIR}\")
set(CKPT_DOCDIR \"${CMAKE_INSTALL_DOCDIR}\")" COMPONENT daemon)
install(SCRIPT cmake/install_deploy.cmake COMPONENT daemon)
